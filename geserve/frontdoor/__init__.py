"""The front door: every request's own work, done where it is decoded (parse aside): checks, placement, responses."""
