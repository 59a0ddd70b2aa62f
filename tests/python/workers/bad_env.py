"""init() with an invalid environment value must raise ValueError naming the variable.

Usage: bad_env.py VARIABLE. Imports no framework (the facade alone), so it starts fast.
"""

import sys

from perseus.common import basics

variable = sys.argv[1]
try:
    basics.init()
except ValueError as e:
    assert variable in str(e), f"the error does not name {variable}: {e}"
else:
    raise AssertionError(f"init() accepted {variable}")
assert not basics.is_initialized()
print(f"WORKER OK ({variable})", flush=True)
