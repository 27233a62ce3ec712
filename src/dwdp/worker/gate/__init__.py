"""The router's gate: the authenticating front of the operator's router pod (``dwdp router-gate``).

vllm-router (0.1.17) authenticates no client and calls the workers with its own key
(``OPENAI_API_KEY``), so a client's ``Authorization`` never reaches the ranks that could judge
it. The gate listens on the router's port, checks the deployment's API key on every path but
the probes', and forwards what passes to a vllm-router child on a loopback port only the pod
reaches; a rotated key (the mounted Secret file changes) restarts the child with the new key.
"""
