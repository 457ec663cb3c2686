"""Compatibility seams: the one place remat touches PyTorch's private APIs (`torch_private`)."""
