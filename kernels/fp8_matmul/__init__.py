"""Weight-only FP8 (e4m3) linear: ``x [M, K] -> [M, N]`` with ``w = fp8 * scale`` per row and group
of inputs (`layerzoo.layers.fp8_linear` holds the weights). ``reference.py`` defines it in torch,
``cpu.py`` calls the C++ GEMV and dequantization (``fp8_cpu.cpp``), ``triton.py`` the CUDA GEMM."""
