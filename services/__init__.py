"""The services of the stack; each folder is one independently started and scaled process kind."""
