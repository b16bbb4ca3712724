"""MXFP4 weights (E2M1 codes, an E8M0 scale per 32 inputs) multiplied as they are stored: the
expert matmul ``y[r] = x[r] @ W[experts[r]]ᵀ`` of routed experts kept packed. ``reference.py``
defines the format in torch, ``cpu.py`` runs the C++ GEMV and dequantization (``mxfp4_cpu.cpp``),
``triton.py`` the CUDA grouped GEMM."""
