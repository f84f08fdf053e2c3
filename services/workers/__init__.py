"""GPU worker services: thin shells around `engine/` (roles: unified now; prefill, decode, vision later)."""
