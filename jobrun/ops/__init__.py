"""Operators' commands: stop, pause, resume, status, doctor, drill, demo, tenants."""
