"""Device backends: the memory, stream, event and copy primitives the DWDP runtime uses.

``base`` fixes the interface; ``cpu`` implements it on host shared memory (what CI runs),
``cuda`` on CUDA VMM through cuda-python, ``fake`` records operations for protocol tests.
"""
