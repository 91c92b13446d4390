"""Triton kernels, one op per module, each with its plain-torch reference beside it.

Tests run them under TRITON_INTERPRET=1 on CPU at small shapes; on a GPU they are the fast path.
"""
