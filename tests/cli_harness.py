"""A command-line process for tests: started with stdout and stderr collected line by line in the
background, so a test can wait on the service it starts and still show everything it printed."""
from __future__ import annotations

import queue
import signal
import subprocess
import threading


class CliProcess:
    def __init__(self, command: list[str], env: dict[str, str] | None = None):
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)

    def output(self) -> str:
        """Everything printed so far."""
        return "".join(self._lines.queue)

    def running(self) -> bool:
        return self.process.poll() is None

    def interrupt(self, timeout_s: float) -> int:
        """Ctrl-C, then the exit code (killed, and an error raised, if it does not exit in time)."""
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.running():
            self.process.kill()
            self.process.wait()
