"""Input: what shippers and the node probe write (any shape, any codec) -> typed log lines or dead letters."""
