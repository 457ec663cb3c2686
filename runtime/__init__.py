"""Runtime: execute a Plan as a drop-in nn.Module."""
