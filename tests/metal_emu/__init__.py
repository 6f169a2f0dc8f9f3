"""CPU emulator and Metal syntax check for bitnest_mlx/metal_kernels (test-only)."""
