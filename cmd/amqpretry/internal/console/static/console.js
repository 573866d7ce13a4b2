// amqpretry console: the only script (CSP: script-src 'self'). The pages work
// without it; it refreshes the overview and ticks every checkbox of a table.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  var every = Number(document.body.dataset.refresh || 0);
  if (every > 0) {
    setTimeout(function () { location.reload(); }, every * 1000);
  }
  document.querySelectorAll("input.select-all").forEach(function (all) {
    all.addEventListener("change", function () {
      all.closest("table").querySelectorAll("tbody input[type=checkbox]").forEach(function (box) {
        box.checked = all.checked;
      });
    });
  });
});
