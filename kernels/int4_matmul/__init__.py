"""Weight-only 4-bit linear: ``x [M, K] -> [M, N]`` with ``w = q * scale - zs`` per group of inputs
(`layerzoo.layers.int4_linear` holds the weights). ``reference.py`` defines the layout in torch,
``cpu.py`` calls the C++ GEMV and dequantization (``int4_cpu.cpp``), ``triton.py`` the CUDA GEMM."""
