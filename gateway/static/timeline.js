// The chunk timeline (SVG): when each streamed chunk arrived against its audio position, the listener's
// playback line, the stalls where the listener ran dry and waited, and the first audible audio: the arrival
// of the chunk that holds the first audible sample (AudibleDetector, below).
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

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

// Draw the chunks (arrival seconds, durations in seconds) into `svg`, and the first audible audio at the
// arrival of chunk `audibleChunk` (null: none heard yet); -> {stalls, stallSeconds}.
function drawTimeline(svg, arrivals, durations, audibleChunk = null) {
  const chunks = listen(arrivals, durations);
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
  if (audibleChunk !== null && audibleChunk < chunks.length) {
    const at = x(chunks[audibleChunk].arrival);
    parts.push(svgElement("line", {class: "audible-mark", "data-chunk": audibleChunk, x1: at, y1: pad, x2: at,
      y2: height - pad}));
  }
  for (const chunk of chunks) {
    parts.push(svgElement("circle", {class: "chunk-mark", cx: x(chunk.arrival), cy: y(chunk.end), r: 3.5}));
  }
  svg.replaceChildren(...parts);
  return {stalls, stallSeconds};
}

// The first audible sample of a stream, by the rule of cosyvoice_triton/pipeline/audible.py (the benchmarks,
// the metrics and the access log use it too): in the first window of `windowMs` whose RMS is above
// `thresholdDbfs` (a window tried at every sample, across chunk boundaries; after the end, silence), the
// first sample whose own level is above it.
class AudibleDetector {
  constructor(sampleRate, thresholdDbfs = -50, windowMs = 10) {
    this.window = Math.max(1, Math.floor(windowMs * sampleRate / 1000 + 0.5)); // samples
    this.level = 10 ** (thresholdDbfs / 10); // mean square (a sample's square) of the threshold
    this.threshold = this.window * this.level; // a window's sum of squares must exceed it
    this.squares = new Float64Array(this.window); // the last window's squares, a ring
    this.sum = 0;
    this.fed = 0; // samples fed (and silence after the end)
    this.starts = []; // each chunk's first sample
    this.offset = null; // the first audible sample, once known
    this.chunk = null; // the index of the chunk that holds it
  }

  // The next chunk (Float32Array); -> true at the one call that finds the first audible sample.
  feed(samples) {
    if (this.offset !== null || !samples.length) return false;
    this.starts.push(this.fed);
    return samples.some((x) => this.push(x));
  }

  // The stream ended: windows running past its end count silence after it; -> true if that finds it.
  finish() {
    if (this.offset !== null || !this.fed) return false;
    for (let k = 1; k < this.window; k += 1) if (this.push(0)) return true;
    return false;
  }

  push(x) {
    const slot = this.fed % this.window;
    this.sum += x * x - this.squares[slot];
    this.squares[slot] = x * x;
    this.fed += 1;
    if (this.fed < this.window || this.sum <= this.threshold) return false;
    let offset = this.fed - this.window; // the window's start; then its first sample above the level
    while (offset < this.fed - 1 && this.squares[offset % this.window] <= this.level) offset += 1;
    this.offset = offset;
    this.chunk = this.starts.findLastIndex((start) => start <= this.offset);
    return true;
  }
}
