"""Several models in one process (``--models-dir``, ``--model-id`` repeated): each request goes to the model it
names, loaded on demand, the least recently used idle one unloaded to make room."""
