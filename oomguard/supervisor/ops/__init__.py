"""The world around a run: systemd, webhooks, the terminal status line, doctor, and the hooks that attach them."""
