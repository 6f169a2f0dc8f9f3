"""mlx-lm integration: mlx-lm's own commands and server on bitnest models (docs/mlx-lm.md).

`plugin` (what the startup hook bitnest_mlx_hook.py hands over to: mlx-lm's loader, generate,
chat and server see bitnest packages and DeepSeek-V4 bundles), `speculation` (mlx-lm's
speculative contract on the shared-cache loop), `serving` / `serving_batch` / `serving_requests`
(`bitnest-server`: mlx-lm's server classes with our loader, batching and request checks).
"""
