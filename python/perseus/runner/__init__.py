"""``perseusrun``: start a Perseus job on one or more hosts.

``hosts`` parses host lists and places ranks, ``job`` spawns ranks, relays their
output and tears the job down, ``launch`` is the command line.
"""
