# Upstream scripts and their ports are run by tests/compat/test_upstream_ports.py with `accel launch`, never
# collected by pytest (Accelerate's test scripts are named test_*.py and take a `state`, not a fixture).
collect_ignore_glob = ["*/**/*.py"]
