// CosyVoice2 web page: voices (GET/POST/DELETE /v1/voices), microphone recording, and streamed
// synthesis over WS /v1/tts/ws played through Web Audio as the chunks arrive.
//
// WebSocket protocol (gateway/routes_ws.py): we send {"type": "start", voice_id, mode, instruct, seed,
// format: "pcm_f32", text} and {"type": "end"}; the gateway answers {"type": "started", seed, ...},
// binary frames of little-endian float32 samples at 24 kHz, {"type": "segment", ...} after each
// sentence, then {"type": "end", audio_seconds, first_chunk_ms, ...}, or {"type": "error", param, message}.
"use strict";

const SAMPLE_RATE = 24000;
const SVG_NS = "http://www.w3.org/2000/svg";
const START_DELAY_S = 0.05; // head room before the first chunk plays
const $ = (id) => document.getElementById(id);

const state = {
  ws: null,
  audio: null, // AudioContext
  nextTime: 0, // when the next chunk starts playing (AudioContext time)
  sources: new Set(),
  chunks: [], // Float32Array of everything received (for the download)
  arrivals: [], // seconds from sending the text to each chunk's arrival (the chunk timeline)
  samples: 0,
  sentAt: 0,
  firstChunkMs: null,
  ended: false,
  failed: false,
  recording: null, // {recorder, stream, parts}
  recorded: null, // Blob (WAV) of the last recording
  downloadUrl: null,
};

// ---- small helpers -------------------------------------------------------------------------------

function apiKey() {
  return $("api-key").value.trim();
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? {...extra, Authorization: `Bearer ${key}`} : extra;
}

async function apiError(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) message = body.error.message || message;
  } catch (_) { /* not JSON */ }
  return new Error(message);
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function setStatus(text, key) {
  const el = $("status");
  el.textContent = text;
  el.dataset.state = key;
}

function setBusy(busy) {
  $("speak").disabled = busy;
  $("stop").disabled = !busy;
}

// ---- server and voices ---------------------------------------------------------------------------

async function checkServer() {
  const el = $("server");
  try {
    const response = await fetch("/readyz", {cache: "no-store"});
    const body = await response.json();
    const servers = Object.keys(body.servers || {}).length;
    el.dataset.ready = body.ready ? "yes" : "no";
    el.textContent = body.ready
      ? `Ready: ${servers} Triton server${servers === 1 ? "" : "s"}`
      : `Not ready yet (default voice: ${body.default_voice || "?"})`;
    return body.ready;
  } catch (err) {
    el.dataset.ready = "no";
    el.textContent = "The gateway cannot be reached.";
    return false;
  }
}

let voices = [];

async function loadVoices(select) {
  const box = $("voice");
  try {
    const response = await fetch("/v1/voices", {headers: headers(), cache: "no-store"});
    if (!response.ok) throw await apiError(response);
    voices = (await response.json()).voices || [];
  } catch (err) {
    showError(`Could not list voices: ${err.message}`);
    return;
  }
  const keep = select || box.value || "default";
  box.replaceChildren();
  if (!voices.length) {
    box.append(new Option("No voices registered yet", ""));
  }
  for (const voice of voices) {
    const label = voice.name && voice.name !== voice.id ? `${voice.name} (${voice.id})` : voice.id;
    box.append(new Option(`${label} — ${Number(voice.prompt_seconds).toFixed(1)} s`, voice.id));
  }
  if (voices.some((v) => v.id === keep)) box.value = keep;
  else if (voices.length) box.value = voices[0].id;
  describeVoice();
}

function describeVoice() {
  const voice = voices.find((v) => v.id === $("voice").value);
  $("voice-info").textContent = voice
    ? (voice.text ? `Transcript: “${voice.text}”` : "Registered without a transcript (use cross-lingual mode).")
    : "";
  $("delete-voice").disabled = !voice;
}

async function deleteVoice() {
  const id = $("voice").value;
  if (!id || !window.confirm(`Delete voice “${id}”?`)) return;
  showError("");
  const response = await fetch(`/v1/voices/${encodeURIComponent(id)}`, {method: "DELETE", headers: headers()});
  if (!response.ok) {
    showError(`Could not delete the voice: ${(await apiError(response)).message}`);
    return;
  }
  await loadVoices("");
}

// ---- recording and registration ------------------------------------------------------------------

function wavBlob(samples, rate) {
  // 16-bit PCM mono WAV
  const data = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const text = (offset, s) => { for (let i = 0; i < s.length; i++) data.setUint8(offset + i, s.charCodeAt(i)); };
  text(0, "RIFF"); data.setUint32(4, 36 + samples.length * 2, true); text(8, "WAVE");
  text(12, "fmt "); data.setUint32(16, 16, true); data.setUint16(20, 1, true); data.setUint16(22, 1, true);
  data.setUint32(24, rate, true); data.setUint32(28, rate * 2, true); data.setUint16(32, 2, true);
  data.setUint16(34, 16, true); text(36, "data"); data.setUint32(40, samples.length * 2, true);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    data.setInt16(44 + i * 2, Math.round(s * 32767), true);
  }
  return new Blob([data.buffer], {type: "audio/wav"});
}

async function toWav(blob) {
  // Anything the browser can decode (webm/opus from MediaRecorder, mp3, m4a...) -> mono WAV.
  const context = new (window.OfflineAudioContext || window.webkitOfflineAudioContext)(1, 1, 48000);
  const buffer = await context.decodeAudioData(await blob.arrayBuffer());
  const mono = new Float32Array(buffer.length);
  for (let c = 0; c < buffer.numberOfChannels; c++) {
    const channel = buffer.getChannelData(c);
    for (let i = 0; i < mono.length; i++) mono[i] += channel[i] / buffer.numberOfChannels;
  }
  return wavBlob(mono, buffer.sampleRate);
}

function preview(blob) {
  const player = $("voice-preview");
  if (player.src) URL.revokeObjectURL(player.src);
  player.src = URL.createObjectURL(blob);
  player.hidden = false;
}

async function toggleRecording() {
  const button = $("record");
  if (state.recording) {
    state.recording.recorder.stop();
    return;
  }
  showError("");
  if (!navigator.mediaDevices || !window.MediaRecorder) {
    showError("Recording needs a browser with MediaRecorder, on https:// or localhost.");
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({audio: true});
  } catch (err) {
    showError(`The microphone is not available: ${err.message}`);
    return;
  }
  const recorder = new MediaRecorder(stream);
  const parts = [];
  recorder.ondataavailable = (event) => { if (event.data.size) parts.push(event.data); };
  recorder.onstop = async () => {
    stream.getTracks().forEach((t) => t.stop());
    state.recording = null;
    button.textContent = "Record with microphone";
    button.setAttribute("aria-pressed", "false");
    try {
      state.recorded = await toWav(new Blob(parts, {type: recorder.mimeType}));
      $("voice-file").value = "";
      preview(state.recorded);
      $("register-status").textContent = "Recording ready: type its transcript and register it.";
    } catch (err) {
      showError(`Could not decode the recording: ${err.message}`);
    }
  };
  state.recording = {recorder, stream, parts};
  recorder.start();
  button.textContent = "Stop recording";
  button.setAttribute("aria-pressed", "true");
  $("register-status").textContent = "Recording… speak now, then press Stop recording.";
}

async function chosenRecording() {
  const file = $("voice-file").files[0];
  if (!file) return state.recorded ? {blob: state.recorded, name: "recording.wav"} : null;
  if (/\.(wav|flac|ogg|oga)$/i.test(file.name)) return {blob: file, name: file.name};
  return {blob: await toWav(file), name: file.name.replace(/\.[^.]*$/, "") + ".wav"};
}

async function registerVoice() {
  showError("");
  const status = $("register-status");
  let recording;
  try {
    recording = await chosenRecording();
  } catch (err) {
    showError(`This file cannot be decoded: ${err.message}`);
    return;
  }
  if (!recording) {
    showError("Choose a recording file or record one first.");
    return;
  }
  const form = new FormData();
  form.append("audio", recording.blob, recording.name);
  form.append("text", $("voice-text").value);
  if ($("voice-id").value.trim()) form.append("id", $("voice-id").value.trim());
  if ($("voice-name").value.trim()) form.append("name", $("voice-name").value.trim());
  $("register").disabled = true;
  status.textContent = "Registering…";
  try {
    const response = await fetch("/v1/voices", {method: "POST", body: form, headers: headers()});
    if (!response.ok) throw await apiError(response);
    const voice = await response.json();
    status.textContent = voice.created === false
      ? `Already registered as “${voice.id}”.` : `Registered “${voice.id}” (${voice.prompt_seconds.toFixed(1)} s).`;
    await loadVoices(voice.id);
  } catch (err) {
    status.textContent = "";
    showError(`Could not register the voice: ${err.message}`);
  } finally {
    $("register").disabled = false;
  }
}

// ---- streamed synthesis --------------------------------------------------------------------------

function audioContext() {
  if (!state.audio) {
    const Context = window.AudioContext || window.webkitAudioContext;
    try {
      state.audio = new Context({sampleRate: SAMPLE_RATE, latencyHint: "interactive"});
    } catch (_) {
      state.audio = new Context(); // buffers stay at 24 kHz; the context resamples
    }
  }
  if (state.audio.state === "suspended") state.audio.resume();
  return state.audio;
}

function play(samples) {
  const context = state.audio;
  const buffer = context.createBuffer(1, samples.length, SAMPLE_RATE);
  buffer.copyToChannel(samples, 0);
  const source = context.createBufferSource();
  source.buffer = buffer;
  source.connect(context.destination);
  const at = Math.max(state.nextTime, context.currentTime + START_DELAY_S);
  source.start(at);
  state.nextTime = at + buffer.duration;
  state.sources.add(source);
  source.onended = () => {
    state.sources.delete(source);
    if (!state.sources.size && state.ended) setStatus("Done", "done");
  };
}

function stopPlayback() {
  for (const source of state.sources) {
    try { source.stop(); } catch (_) { /* not started */ }
  }
  state.sources.clear();
  state.nextTime = 0;
}

function resetStats() {
  state.chunks = [];
  state.arrivals = [];
  $("stalls").textContent = "0";
  $("stall-ms").textContent = "0";
  $("timeline").replaceChildren();
  $("timeline-figure").hidden = true;
  state.samples = 0;
  state.firstChunkMs = null;
  state.ended = false;
  state.failed = false;
  $("first-chunk").textContent = "–";
  $("audio-seconds").textContent = "0.00";
  $("chunks").textContent = "0";
  $("used-seed").textContent = "–";
  $("meter-bar").style.width = "0";
  $("download").hidden = true;
}

function onAudio(data) {
  const samples = new Float32Array(data);
  if (!samples.length) return;
  if (state.firstChunkMs === null) {
    state.firstChunkMs = performance.now() - state.sentAt;
    $("first-chunk").textContent = state.firstChunkMs.toFixed(0);
    setStatus("Streaming", "streaming");
  }
  state.chunks.push(samples);
  state.arrivals.push((performance.now() - state.sentAt) / 1000);
  state.samples += samples.length;
  $("audio-seconds").textContent = (state.samples / SAMPLE_RATE).toFixed(2);
  $("chunks").textContent = String(state.chunks.length);
  $("meter-bar").style.width = `${Math.min(100, (state.samples / SAMPLE_RATE) * 10)}%`;
  play(samples);
  drawTimeline();
}

// ---- chunk timeline ------------------------------------------------------------------------------

// The listener of cosyvoice_triton/runtime/playback.py (as the benchmarks count stalls): it plays the
// chunks back to back from the first one's arrival and waits when the next has not arrived yet.
// -> [{arrival, start, end (audio seconds), playFrom, stall (seconds waited before it)}]
function listen(arrivals, durations) {
  const out = [];
  let playedUntil = null;
  let position = 0;
  arrivals.forEach((arrival, k) => {
    const stall = playedUntil === null ? 0 : Math.max(0, arrival - playedUntil);
    const playFrom = playedUntil === null ? arrival : Math.max(arrival, playedUntil);
    out.push({arrival, start: position, end: position + durations[k], playFrom, stall});
    position += durations[k];
    playedUntil = playFrom + durations[k];
  });
  return out;
}

function svgElement(name, attributes) {
  const element = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, String(value));
  return element;
}

function drawTimeline() {
  const chunks = listen(state.arrivals, state.chunks.map((c) => c.length / SAMPLE_RATE));
  const svg = $("timeline");
  const [width, height, pad] = [600, 160, 6];
  const last = chunks[chunks.length - 1];
  const tMax = Math.max(last.playFrom + last.end - last.start, 0.001);
  const aMax = Math.max(last.end, 0.001);
  const x = (t) => pad + (t / tMax) * (width - 2 * pad);
  const y = (a) => height - pad - (a / aMax) * (height - 2 * pad);
  const parts = [svgElement("line", {class: "axis", x1: pad, y1: y(0), x2: width - pad, y2: y(0)})];
  let stalls = 0;
  let stallSeconds = 0;
  const points = [`${x(chunks[0].arrival)},${y(0)}`];
  for (const chunk of chunks) {
    if (chunk.stall > 0) {
      stalls += 1;
      stallSeconds += chunk.stall;
      parts.push(svgElement("rect", {class: "stall-mark", x: x(chunk.playFrom - chunk.stall), y: pad,
        width: Math.max(1, x(chunk.playFrom) - x(chunk.playFrom - chunk.stall)), height: height - 2 * pad}));
    }
    points.push(`${x(chunk.playFrom)},${y(chunk.start)}`, `${x(chunk.playFrom + chunk.end - chunk.start)},${y(chunk.end)}`);
  }
  parts.push(svgElement("polyline", {class: "played", points: points.join(" ")}));
  for (const chunk of chunks) {
    parts.push(svgElement("circle", {class: "chunk-mark", cx: x(chunk.arrival), cy: y(chunk.end), r: 3.5}));
  }
  svg.replaceChildren(...parts);
  $("timeline-figure").hidden = false;
  $("stalls").textContent = String(stalls);
  $("stall-ms").textContent = (1000 * stallSeconds).toFixed(0);
}

function onMessage(message, raw) {
  if (message.type === "started") {
    const seed = /"seed":\s*(\d+)/.exec(raw); // exact digits (JSON.parse rounds numbers past 2^53)
    $("used-seed").textContent = seed ? seed[1] : String(message.seed);
  } else if (message.type === "end") {
    state.ended = true;
    finishDownload();
    setBusy(false);
    setStatus(state.sources.size ? "Received all audio, playing" : "Done", state.sources.size ? "playing" : "done");
    $("status").dataset.serverFirstChunkMs = message.first_chunk_ms == null ? "" : message.first_chunk_ms.toFixed(0);
  } else if (message.type === "error") {
    state.failed = true;
    showError(message.message || "The synthesis failed.");
    setStatus("Failed", "error");
    setBusy(false);
  }
}

function finishDownload() {
  if (!state.samples) return;
  const all = new Float32Array(state.samples);
  let at = 0;
  for (const chunk of state.chunks) { all.set(chunk, at); at += chunk.length; }
  if (state.downloadUrl) URL.revokeObjectURL(state.downloadUrl);
  state.downloadUrl = URL.createObjectURL(wavBlob(all, SAMPLE_RATE));
  const link = $("download");
  link.href = state.downloadUrl;
  link.hidden = false;
}

function speak() {
  showError("");
  const text = $("text").value;
  if (!text.trim()) {
    showError("Type some text first.");
    $("text").focus();
    return;
  }
  const voice = $("voice").value;
  if (!voice) {
    showError("Choose a voice first (or register one below).");
    return;
  }
  const start = {type: "start", voice_id: voice, mode: $("mode").value, format: "pcm_f32", text};
  if (start.mode === "instruct2") start.instruct = $("instruct").value;
  const seed = $("seed").value.trim().replace(/^0+(?=\d)/, ""); // JSON numbers have no leading zeros
  if (seed !== "" && !/^\d+$/.test(seed)) {
    showError("The seed must be a whole number from 0 to 2^63 - 1.");
    return;
  }
  // Seeds go up to 2^63 - 1, past what a JavaScript number holds exactly: the digits go into the JSON as they are.
  const startJson = seed === "" ? JSON.stringify(start) : `${JSON.stringify(start).slice(0, -1)},"seed":${seed}}`;

  stopSpeaking(false);
  resetStats();
  audioContext(); // created inside the click: browsers let it play
  setBusy(true);
  setStatus("Connecting", "connecting");

  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const key = apiKey();
  const ws = new WebSocket(`${scheme}//${location.host}/v1/tts/ws${key ? `?api_key=${encodeURIComponent(key)}` : ""}`);
  ws.binaryType = "arraybuffer";
  state.ws = ws;
  ws.onopen = () => {
    state.sentAt = performance.now();
    ws.send(startJson);
    ws.send(JSON.stringify({type: "end"}));
    setStatus("Waiting for audio", "waiting");
  };
  ws.onmessage = (event) => {
    if (ws !== state.ws) return;
    if (typeof event.data === "string") onMessage(JSON.parse(event.data), event.data);
    else onAudio(event.data);
  };
  ws.onerror = () => {
    if (ws !== state.ws || state.failed) return;
    state.failed = true;
    showError("The WebSocket connection failed.");
  };
  ws.onclose = (event) => {
    if (ws !== state.ws) return;
    state.ws = null;
    setBusy(false);
    if (!state.ended && !state.failed) {
      state.failed = true;
      showError(`The connection closed before the end (code ${event.code}${event.reason ? `: ${event.reason}` : ""}).`);
      setStatus("Failed", "error");
    }
  };
}

function stopSpeaking(update = true) {
  const ws = state.ws;
  state.ws = null;
  if (ws && ws.readyState <= WebSocket.OPEN) ws.close(1000, "stopped"); // the gateway cancels the synthesis
  stopPlayback();
  if (update) {
    setBusy(false);
    finishDownload();
    if (!state.ended) setStatus("Stopped", "stopped");
  }
}

// ---- wiring --------------------------------------------------------------------------------------

function init() {
  $("api-key").value = localStorage.getItem("cosyvoice-api-key") || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("cosyvoice-api-key", apiKey());
    loadVoices();
  });
  $("settings").addEventListener("submit", (event) => { event.preventDefault(); $("api-key").blur(); });
  $("voice").addEventListener("change", describeVoice);
  $("refresh-voices").addEventListener("click", () => { showError(""); loadVoices(); });
  $("delete-voice").addEventListener("click", deleteVoice);
  $("mode").addEventListener("change", () => { $("instruct-field").hidden = $("mode").value !== "instruct2"; });
  $("speak").addEventListener("click", speak);
  $("stop").addEventListener("click", () => stopSpeaking(true));
  $("text").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) speak();
  });
  $("record").addEventListener("click", toggleRecording);
  $("voice-file").addEventListener("change", () => {
    const file = $("voice-file").files[0];
    if (file) { state.recorded = null; preview(file); }
  });
  $("register").addEventListener("click", registerVoice);
  checkServer().then((ready) => {
    loadVoices();
    if (!ready) {
      const timer = setInterval(async () => {
        if (await checkServer()) { clearInterval(timer); loadVoices(); }
      }, 2000);
    }
  });
}

document.addEventListener("DOMContentLoaded", init);
