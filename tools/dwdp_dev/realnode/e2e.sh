#!/bin/bash
# End-to-end probe of the real node (issue 36): control plane, containerd, kubelet, a pod,
# kube-proxy (mode $RN_PROXY_MODE, default iptables), a Service reached from the host and
# from the pod, logs/exec/port-forward; then down.sh. Needs /tmp/rn/bin/{devnode,pause} and
# /tmp/rn/{pause,busybox}.tar (build-node.sh, mkimage.py). Args: STATE_DIR HOST_IP.
set -u
R=$(cd "$(dirname "$0")" && pwd)
S=${1:-/tmp/rn/cp}; HOST_IP=${2:-192.0.2.2}; POD_CIDR=10.244.0.0/24
K="$HOME/.cache/dwdp/tools/kubectl-v37-2.0.0/bin/kubectl --kubeconfig $S/kubeconfig"
t() { echo "[$(date +%T.%N | cut -c1-12)] $*"; }
t "control plane"; PYTHONPATH=$R/../.. /work/main/.venv/bin/python $R/up.py $S $HOST_IP $POD_CIDR up || exit 1
t "containerd"; $R/run-containerd.sh || exit 1
t "kubelet"; HOST_IP=$HOST_IP $R/run-kubelet.sh $S
for _ in $(seq 300); do [ "$($K get node rn-node -o jsonpath="{.status.conditions[?(@.type==\"Ready\")].status}" 2>/dev/null)" = True ] && break; sleep 0.2; done
t "node Ready"
for _ in $(seq 100); do $K get sa default >/dev/null 2>&1 && break; sleep 0.2; done
$K apply -f - >/dev/null <<'Y'
apiVersion: v1
kind: Pod
metadata: {name: web, labels: {app: web}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: web
    image: dwdp.local/busybox:dev
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", "mkdir -p /www && echo hello-from-real-node > /www/index.html && echo started && exec /bin/busybox httpd -f -v -p 8080 -h /www"]
    ports: [{containerPort: 8080}]
Y
$K wait --for=condition=Ready pod/web --timeout=60s >/dev/null && t "pod Ready: $($K get pod web -o jsonpath='{.status.podIP}')"
# local route for the Service CIDR BEFORE kube-proxy; guard against forwarding off the host
ip route add 10.0.0.0/24 dev lo
iptables -I FORWARD 1 -o eth0 -j DROP -m comment --comment rn-probe-no-offhost
iptables -I FORWARD 1 -i eth0 -j DROP -m comment --comment rn-probe-no-offhost
sysctl -qw net.ipv4.ip_forward=1
[ "${RN_PROXY_MODE:-iptables}" != iptables ] && sed -i "s/^mode: .*/mode: $RN_PROXY_MODE/" $S/kube-proxy.yaml
$R/run-kube-proxy.sh $S >/dev/null
$K expose pod web --port 80 --target-port 8080 >/dev/null
IP=$($K get svc web -o jsonpath='{.spec.clusterIP}')
case $IP in 10.0.0.*) ;; *) echo "no ClusterIP in the locally routed 10.0.0.0/24: '$IP'"; $R/down.sh $S; exit 1;; esac
for _ in $(seq 50); do curl -s -m 1 http://$IP/ >/dev/null && break; sleep 0.2; done
t "host -> ClusterIP $IP: $(curl -s -m 3 http://$IP/)"
t "pod -> ClusterIP: $($K exec web -- /bin/sh -c "printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 3 $IP 80 | tail -1")"
t "pod -> kubernetes svc: $($K exec web -- /bin/sh -c 'echo | nc -w 3 10.0.0.1 443 && echo open')"
t "logs: $($K logs web | head -1)"
$K port-forward pod/web 28080:8080 >/dev/null 2>&1 & PF=$!; sleep 2
t "port-forward: $(curl -s -m 3 127.0.0.1:28080)"; kill $PF
t "down"; RN_IP_FORWARD=${RN_IP_FORWARD:-0} $R/down.sh $S
t "done"
