"""vitscale: pretrain/transfer."""
