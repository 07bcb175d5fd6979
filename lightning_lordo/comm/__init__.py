"""Collectives and what travels: counted, time-bounded collectives, reduced-precision messages and the low-rank
payload. No optimizer imports."""
