// Render the docs' LaTeX (pymdownx.arithmatex, generic mode) with the KaTeX copy served beside this file.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\[", right: "\\]", display: true },
      { left: "\\(", right: "\\)", display: false },
    ],
    throwOnError: false,
  });
});
