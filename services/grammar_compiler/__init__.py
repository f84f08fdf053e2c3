"""Grammar compiler: output constraints -> checked llguidance grammar text, in child processes with
a hard timeout, cached by constraint key (README.md)."""
