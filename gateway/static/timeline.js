// The chunk timeline (SVG): when each streamed chunk arrived against its audio position, the listener's
// playback line, and the stalls where the listener ran dry and waited.
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

// Draw the chunks (arrival seconds, durations in seconds) into `svg`; -> {stalls, stallSeconds}.
function drawTimeline(svg, arrivals, durations) {
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
  for (const chunk of chunks) {
    parts.push(svgElement("circle", {class: "chunk-mark", cx: x(chunk.arrival), cy: y(chunk.end), r: 3.5}));
  }
  svg.replaceChildren(...parts);
  return {stalls, stallSeconds};
}
