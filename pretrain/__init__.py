"""vitscale: pretrain."""
