"""`epd trace`: one request's path rebuilt from log lines (timeline.py), as Chrome trace events
(chrome.py); the command is command.py."""
