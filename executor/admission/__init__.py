"""Admission's host-side checks beside `executor/validation.py`: the host kernel's pass over a
usual batch (`host_checks.py`) and the slot-owner map (`slot_owners.py`)."""
