#!/usr/bin/env python3
"""ssh ProxyCommand for the cluster smoke run: relay stdin/stdout to HOST:PORT (the script's
own sshd on a loopback port; Ray's launcher config has no ssh port setting, only a proxy).

    ProxyCommand=python3 scripts/ssh_loopback_proxy.py 127.0.0.1 PORT
"""

import os
import selectors
import socket
import sys


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    assert host.startswith("127."), "the smoke run talks only to loopback addresses"
    sock = socket.create_connection((host, port), timeout=10)
    sock.settimeout(None)
    sel = selectors.DefaultSelector()
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    sel.register(stdin, selectors.EVENT_READ, "in")
    sel.register(sock, selectors.EVENT_READ, "sock")
    while True:
        for key, _ in sel.select():
            if key.data == "in":
                data = os.read(stdin, 65536)
                if not data:
                    sel.unregister(stdin)
                    sock.shutdown(socket.SHUT_WR)
                    continue
                sock.sendall(data)
            else:
                data = sock.recv(65536)
                if not data:
                    return 0
                view = memoryview(data)
                while view:
                    view = view[os.write(stdout, view):]


if __name__ == "__main__":
    sys.exit(main())
