"""Starting ranks: the local launcher and the environment torchrun sets."""
