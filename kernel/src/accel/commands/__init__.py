"""The ``accel`` command line. Nothing here imports torch unless a script is launched or a check needs it."""
