print("ready", flush=True)  # first statement: launch latency is measured until this line appears
