"""DSV inside other libraries' models.

- `dsv.integrations.diffusers`: `install_dsv(transformer, cfg)` puts DSV self-attention into a diffusers
  `WanTransformer3DModel` or `CogVideoXTransformer3DModel` (needs `pip install 'dsv[integrations]'`).

Each integration is imported on its own, so that `import dsv` never needs the other library.
"""
