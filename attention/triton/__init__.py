"""The Triton attention backend.

- `backend.py`: the backend (metadata, capture/replay, `forward`); imports no triton.
- `launch.py`: grids, block sizes and split counts, plain Python and torch (CPU-tested).
- `kv_indices.py`, `decode_attention.py`, `extend_attention.py`: the kernels and their
  launch wrappers (import triton); `kernels.py` gathers the wrappers for the backend, which
  imports it only when a backend is created.
"""
