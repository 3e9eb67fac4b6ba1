// Speech marks on the page (docs/api/speech-marks.md): the text being spoken, each sentence highlighted while
// its audio plays. The WebSocket session asks for marks ({"marks": true} in its start message) and the
// gateway sends {"type": "mark", "mark": {type, index, start_ms, end_ms, start, end, value}} before the audio a
// mark describes (a sentence's end_ms null until {"type": "mark_end", index, end_ms} follows its last audio).
// `start`/`end` are the mark's characters in the session's text, `start_ms`/`end_ms` its place in the audio.
"use strict";

class SpokenText {
  // `element`: where the text is shown; `playedMs()`: how much of the audio has played, in ms.
  constructor(element, playedMs) {
    this.element = element;
    this.playedMs = playedMs;
    this.reset("");
  }

  reset(text) {
    this.text = text;
    this.sentences = []; // sentence marks in order, each with its <span>
    this.current = null;
    this.frame = null;
    this.element.replaceChildren(document.createTextNode(text));
    this.element.hidden = true;
    this.element.dataset.current = "";
    this.element.dataset.history = ""; // the sentences highlighted, in order (the page's tests read it)
  }

  // A mark event of the stream: a mark (sentences are shown; <mark>s and <break>s have no text to show) or a
  // mark_end.
  add(event) {
    if (event.type === "mark_end") {
      const sentence = this.sentences.find((s) => s.index === event.index);
      if (sentence) sentence.end_ms = event.end_ms;
      return;
    }
    if (event.type !== "sentence") return;
    this.sentences.push({...event});
    this.render();
    if (!this.frame) this.frame = requestAnimationFrame(() => this.follow());
  }

  // The text with a <span class="sentence"> over each sentence's characters.
  render() {
    const nodes = [];
    let at = 0;
    for (const sentence of this.sentences) {
      if (sentence.start < at) continue; // spans never overlap; a stray one is not drawn
      nodes.push(document.createTextNode(this.text.slice(at, sentence.start)));
      sentence.span = document.createElement("span");
      sentence.span.className = "sentence";
      sentence.span.dataset.index = String(sentence.index);
      sentence.span.textContent = this.text.slice(sentence.start, sentence.end);
      nodes.push(sentence.span);
      at = sentence.end;
    }
    nodes.push(document.createTextNode(this.text.slice(at)));
    this.element.replaceChildren(...nodes);
    this.element.hidden = false;
    this.highlight(this.current);
  }

  // The sentence whose audio is playing now (its end still unknown: until the next one starts).
  playing(ms) {
    return this.sentences.find((s) => s.start_ms <= ms && (s.end_ms === null || ms < s.end_ms)) || null;
  }

  highlight(sentence) {
    for (const s of this.sentences) if (s.span) s.span.classList.toggle("speaking", s === sentence);
    if (sentence === this.current) return;
    this.current = sentence;
    this.element.dataset.current = sentence ? String(sentence.index) : "";
    if (sentence) {
      const history = this.element.dataset.history;
      this.element.dataset.history = history ? `${history},${sentence.index}` : String(sentence.index);
    }
  }

  // Follow the playback on each animation frame until it stops.
  follow() {
    this.frame = null;
    const playing = this.playing(this.playedMs());
    this.highlight(playing);
    if (this.following) this.frame = requestAnimationFrame(() => this.follow());
  }

  get following() {
    return this.sentences.length > 0 && this.active;
  }

  start() {
    this.active = true;
  }

  // Playback ended or stopped: no sentence is being spoken.
  stop() {
    this.active = false;
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = null;
    this.highlight(null);
  }
}
