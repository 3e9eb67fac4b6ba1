"""Whether a running tritonserver still answers: probes for `up`'s supervisor (server/supervisor.py).

A server can run and yet be stuck: a deadlock inside a Python-backend stub (the one found is
avoided, triton/grpc_llm.py) leaves the process alive while every stream in it waits forever. `Liveness`
probes the server's Python models that hold streams with requests each answers in `execute` at once,
without a worker, the LLM's slots or the flow, and counted nowhere: `cosyvoice2` gets an empty bistream
text piece for a text stream nobody reads (`PROBE_STREAM_ID`: its feed is dropped unclaimed), `llm` a
cancel of a stream id nobody uses; each is answered with an empty final. A
model that answers none of `hung_after` probes in a row, each given `timeout_s`, is hung: the supervisor
kills the server and starts it again, and the streams it held fail at once (the gateway and clients see
the error) instead of waiting. A server that is down or restarting is not probed (the supervisor sees
its exit); a probe that cannot connect counts as answered: only silence is a hang.

token2wav is not probed: a batch of full-size first chunks on a CPU may keep its execute busy longer
than any probe timeout that still finds a hang quickly.
"""
from __future__ import annotations

import logging
import secrets
import threading
from pathlib import Path

from cosyvoice_triton.errors import CosyVoiceError, DeadlineExceeded
from cosyvoice_triton.wire.names import COSYVOICE2, COSYVOICE3, LLM
from cosyvoice_triton.wire.requests import TextAppend
from cosyvoice_triton.wire.stage_tensors import llm_cancel_inputs

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 10.0
HUNG_AFTER = 3  # probes in a row without an answer: 3 x (10 s + 5 s) = a hang is acted on within ~45 s


PROBE_STREAM_ID = "liveness-probe"


def probe_values(model: str) -> dict:
    """The probe request of `model`: answered by its execute at once (see the module docstring)."""
    if model == LLM:
        return llm_cancel_inputs(PROBE_STREAM_ID)
    return TextAppend(PROBE_STREAM_ID, "").tensors()


PROBED_MODELS = (COSYVOICE2, COSYVOICE3, LLM)  # those the server holds: one synthesis model, named for its family


def answers(target: str, model: str, timeout_s: float) -> bool:
    """Whether `model` of the server at `target` (host:port) answers a probe within `timeout_s`."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from cosyvoice_triton.wire.call_reader import CallReader
    from cosyvoice_triton.wire.grpc_messages import CHANNEL_OPTIONS, infer_request

    done = threading.Event()

    def requests():
        yield infer_request(model, probe_values(model), f"liveness-{secrets.token_hex(4)}", empty_final=True)
        done.wait(timeout_s)

    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests(), timeout=timeout_s)
        try:
            for _ in CallReader(call, on_end=done.set):
                pass
        except DeadlineExceeded:
            return False
        except CosyVoiceError:  # an answer with an error, or no connection: not silence
            return True
        finally:
            done.set()
    return True


class Liveness:
    """Probes one `TritonProcess` every `interval_s` in a thread of its own; `hung` names a model that did
    not answer `hung_after` probes in a row (None: all answer)."""

    def __init__(self, process, interval_s: float = PROBE_INTERVAL_S, timeout_s: float = PROBE_TIMEOUT_S,
                 hung_after: int = HUNG_AFTER):
        self.process = process
        self.interval_s, self.timeout_s, self.hung_after = interval_s, timeout_s, hung_after
        self._silent: dict[str, int] = {}  # model -> probes in a row without an answer
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)

    @property
    def hung(self) -> str | None:
        with self._lock:
            return next((model for model, silent in self._silent.items() if silent >= self.hung_after), None)

    def reset(self) -> None:
        """Forget the silence: the server was restarted."""
        with self._lock:
            self._silent.clear()

    def probed_models(self) -> list[str]:
        repository = Path(self.process.model_repository)
        return [model for model in PROBED_MODELS if (repository / model).is_dir()]

    def probe_once(self) -> None:
        if not self.process.is_running():
            return
        target = self.process.grpc_url
        for model in self.probed_models():
            answered = answers(target, model, self.timeout_s)
            with self._lock:
                self._silent[model] = 0 if answered else self._silent.get(model, 0) + 1
            if not answered:
                log.warning("%s: %s did not answer a liveness probe within %.0f s (%d in a row)", target, model,
                            self.timeout_s, self._silent[model])

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.probe_once()
            except Exception:  # noqa: BLE001 - a failed probe round; the next one tries again
                log.exception("liveness probe failed")
