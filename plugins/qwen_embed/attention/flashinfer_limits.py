"""What flashinfer's prebuilt kernels cover, known without importing flashinfer."""

# Head sizes with prebuilt (AOT) kernels in flashinfer 0.2.x; its fa3 kernels static_assert
# exactly these, so any other size fails at the first launch, not at load.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
