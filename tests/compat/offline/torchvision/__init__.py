"""A stand-in for torchvision on machines where it cannot be installed (PyPI's torchvision 0.28.0 links CUDA's
libraries and does not load with the CPU build of torch 2.13.0): only ``torchvision.transforms``, the part the ported
diffusers scripts use, in pure torch. ``test_upstream_ports.py`` puts this folder on ``PYTHONPATH`` only when the
real torchvision does not import."""
