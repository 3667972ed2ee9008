"""The Triton attention backend (`backend`), its kernels (`kernels`, imports triton) and their
launch parameters (`launch`, plain Python, tested on CPU).

Importing this package does not import triton; creating the backend does.
"""
