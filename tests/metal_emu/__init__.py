"""Metal syntax check for bitnest_mlx/metal_kernels (test-only); `emulator` re-exports the CPU
emulator from bitnest_mlx.kernels.emulator."""
