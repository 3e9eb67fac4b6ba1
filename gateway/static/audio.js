// Audio for the page: WAV files in and out, the microphone, and a Player that schedules float32 chunks on
// Web Audio as they arrive and draws the live waveform of what has played.
"use strict";

const SAMPLE_RATE = 24000;
const START_DELAY_S = 0.05; // head room before the first chunk plays

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

// A file the gateway decodes itself (WAV, FLAC, OGG) as it is; anything else through the browser's decoder.
async function uploadable(file) {
  if (/\.(wav|flac|ogg|oga)$/i.test(file.name)) return {blob: file, name: file.name};
  return {blob: await toWav(file), name: file.name.replace(/\.[^.]*$/, "") + ".wav"};
}

function joinChunks(chunks, total) {
  const all = new Float32Array(total);
  let at = 0;
  for (const chunk of chunks) { all.set(chunk, at); at += chunk.length; }
  return all;
}

// ---- the microphone ------------------------------------------------------------------------------

// Toggle recording on `button`: the first press starts, the second stops; onDone(wavBlob) or onError(message).
function microphoneButton(button, {onStart, onDone, onError}) {
  let recording = null;
  const idle = button.textContent;
  button.addEventListener("click", async () => {
    if (recording) { recording.recorder.stop(); return; }
    if (!navigator.mediaDevices || !window.MediaRecorder) {
      onError("Recording needs a browser with MediaRecorder, on https:// or localhost.");
      return;
    }
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({audio: true});
    } catch (err) {
      onError(`The microphone is not available: ${err.message}`);
      return;
    }
    const recorder = new MediaRecorder(stream);
    const parts = [];
    recorder.ondataavailable = (event) => { if (event.data.size) parts.push(event.data); };
    recorder.onstop = async () => {
      stream.getTracks().forEach((t) => t.stop());
      recording = null;
      button.textContent = idle;
      button.setAttribute("aria-pressed", "false");
      try {
        onDone(await toWav(new Blob(parts, {type: recorder.mimeType})));
      } catch (err) {
        onError(`Could not decode the recording: ${err.message}`);
      }
    };
    recording = {recorder};
    recorder.start();
    button.textContent = "Stop recording";
    button.setAttribute("aria-pressed", "true");
    onStart();
  });
}

// ---- the live waveform ---------------------------------------------------------------------------

// Per column of the drawing, the lowest and highest sample of its share of `samples` (the envelope).
// -> [[min, max], ...] of `columns` pairs (fewer when there are fewer samples).
function waveformPeaks(samples, columns) {
  const n = Math.min(columns, samples.length);
  const peaks = [];
  for (let c = 0; c < n; c++) {
    const from = Math.floor((c * samples.length) / n);
    const to = Math.floor(((c + 1) * samples.length) / n);
    let low = Infinity;
    let high = -Infinity;
    for (let i = from; i < to; i++) {
      if (samples[i] < low) low = samples[i];
      if (samples[i] > high) high = samples[i];
    }
    peaks.push([low, high]);
  }
  return peaks;
}

function drawWaveform(canvas, samples, playedSeconds) {
  const ratio = window.devicePixelRatio || 1;
  const width = Math.max(1, Math.round(canvas.clientWidth * ratio));
  const height = Math.max(1, Math.round(canvas.clientHeight * ratio));
  if (canvas.width !== width || canvas.height !== height) { canvas.width = width; canvas.height = height; }
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, width, height);
  const peaks = waveformPeaks(samples, width);
  const seconds = samples.length / SAMPLE_RATE;
  const playedColumns = seconds ? Math.round((Math.min(playedSeconds, seconds) / seconds) * peaks.length) : 0;
  const style = getComputedStyle(canvas);
  const scale = Math.max(1e-3, ...peaks.map(([low, high]) => Math.max(-low, high))); // loudest sample: full height
  const y = (value) => height / 2 - (value / scale) * (height / 2 - 2);
  peaks.forEach(([low, high], column) => {
    context.fillStyle = style.getPropertyValue(column < playedColumns ? "--played" : "--unplayed").trim();
    const x = (column * width) / peaks.length;
    context.fillRect(x, y(high), Math.max(1, width / peaks.length), Math.max(1, y(low) - y(high)));
  });
  canvas.dataset.receivedSeconds = seconds.toFixed(3);
  canvas.dataset.playedSeconds = Math.min(playedSeconds, seconds).toFixed(3);
  canvas.dataset.columns = String(peaks.length);
  canvas.dataset.playedColumns = String(playedColumns);
}

// ---- playback ------------------------------------------------------------------------------------

// Plays float32 chunks back to back on one AudioContext as they come, keeps them (for a download), and
// redraws `canvas` (the waveform, coloured as far as it has played) on each animation frame while playing.
class Player {
  constructor(canvas, onDrained) {
    this.canvas = canvas;
    this.onDrained = onDrained; // called when the last scheduled chunk has played
    this.context = null;
    this.reset();
  }

  // Create (or wake) the AudioContext: call it inside a click, so that browsers let it play.
  open() {
    if (!this.context) {
      const Context = window.AudioContext || window.webkitAudioContext;
      try {
        this.context = new Context({sampleRate: SAMPLE_RATE, latencyHint: "interactive"});
      } catch (_) {
        this.context = new Context(); // buffers stay at 24 kHz; the context resamples
      }
    }
    if (this.context.state === "suspended") this.context.resume();
  }

  reset() {
    this.stop();
    this.stopped = false;
    this.chunks = [];
    this.joined = null;
    this.scheduled = []; // [{at (AudioContext time), duration}] of each chunk
    this.samples = 0;
    this.canvas.parentElement.hidden = true;
  }

  add(samples) {
    this.chunks.push(samples);
    this.samples += samples.length;
    const buffer = this.context.createBuffer(1, samples.length, SAMPLE_RATE);
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const at = Math.max(this.nextTime, this.context.currentTime + START_DELAY_S);
    source.start(at);
    this.nextTime = at + buffer.duration;
    this.scheduled.push({at, duration: buffer.duration});
    this.sources.add(source);
    source.onended = () => {
      this.sources.delete(source);
      if (!this.sources.size) {
        this.draw();
        this.onDrained();
      }
    };
    this.canvas.parentElement.hidden = false;
    if (!this.frame) this.frame = requestAnimationFrame(() => this.animate());
  }

  get playing() {
    return this.sources.size > 0;
  }

  // Seconds of the received audio that have played by now.
  playedSeconds() {
    if (!this.context || !this.scheduled) return 0;
    const now = this.context.currentTime;
    return this.scheduled.reduce((sum, {at, duration}) => sum + Math.min(duration, Math.max(0, now - at)), 0);
  }

  // Every sample received so far, as one array (joined again only when more came).
  all() {
    if (!this.joined || this.joined.length !== this.samples) this.joined = joinChunks(this.chunks, this.samples);
    return this.joined;
  }

  draw() {
    drawWaveform(this.canvas, this.all(), this.stopped ? this.stoppedAt : this.playedSeconds());
  }

  animate() {
    this.frame = null;
    this.draw();
    if (this.playing) this.frame = requestAnimationFrame(() => this.animate());
  }

  // Silence what is scheduled; the waveform keeps what had played by then.
  stop() {
    this.stoppedAt = this.playedSeconds();
    this.stopped = true;
    for (const source of this.sources || []) {
      source.onended = null;
      try { source.stop(); } catch (_) { /* not started */ }
    }
    this.sources = new Set();
    this.nextTime = 0;
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = null;
    if (this.samples) this.draw();
  }
}
