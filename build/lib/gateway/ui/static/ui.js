// agentrl trace viewer: token colouring modes, the hovered token's details, expand-all. No dependencies.
(function () {
  "use strict";
  function ready(fn) { if (document.readyState !== "loading") fn(); else document.addEventListener("DOMContentLoaded", fn); }
  ready(function () {
    var tokens = document.getElementById("tokens");
    var info = document.getElementById("tok-info");
    if (tokens) {
      document.querySelectorAll("button.mode").forEach(function (btn) {
        btn.addEventListener("click", function () {
          tokens.classList.remove("mode-mask", "mode-logprob", "mode-version");
          tokens.classList.add("mode-" + btn.dataset.mode);
          document.querySelectorAll("button.mode").forEach(function (b) { b.classList.toggle("on", b === btn); });
        });
      });
      tokens.addEventListener("mouseover", function (ev) {
        var t = ev.target.closest ? ev.target.closest(".tok") : null;
        if (!t || !info) return;
        var d = t.dataset;
        var text = JSON.stringify(t.textContent.replace(/\u21b5\n/g, "\n").replace(/\u21e5/g, "\t"));
        info.textContent = "#" + d.i + "  id " + d.id + "  " + text + "  " + d.kind + " (turn " + d.turn + ")" +
          "  mask " + d.mask + (d.lp !== "" ? "  logprob " + Number(d.lp).toFixed(4) + "  p " + Math.exp(Number(d.lp)).toFixed(3) : "") +
          (Number(d.v) >= 0 ? "  version " + d.v : "");
      });
    }
    var expand = document.getElementById("expand-all");
    if (expand) {
      expand.addEventListener("click", function () {
        var open = expand.dataset.open !== "1";
        document.querySelectorAll("details.conv").forEach(function (d) { d.open = open; });
        expand.dataset.open = open ? "1" : "0";
        expand.textContent = open ? "collapse all messages" : "expand all messages";
      });
    }
  });
})();
