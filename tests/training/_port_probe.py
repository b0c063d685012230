"""A rank for the launcher tests: exits 0 if ``$MASTER_PORT`` is already held when it starts
(someone listens on it), 7 if this process could bind it itself."""

import os
import socket
import sys

if __name__ == "__main__":
    with socket.socket() as sock:
        try:
            sock.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        except OSError:
            sys.exit(0)
    sys.exit(7)
