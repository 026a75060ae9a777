"""``fedlight bench`` (``tools/bench.py``, ``tools/gpu_profile.py``): what a fedlight round costs next
to a minimal PyTorch loop and peers, on CPU and GPU, and the route candidates measured there.
"""
