"""opd kernels: chunked selective log-softmax and reverse KL (torch on CPU, Triton on GPU)."""
