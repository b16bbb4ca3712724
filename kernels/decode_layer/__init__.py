"""One decode step of a plain pre-norm attention + SwiGLU layer as one C++ call (its source ships
here; `layerzoo.kernels.cpp_build` builds it, `layerzoo.layers.fused_decode` plans and calls it)."""
