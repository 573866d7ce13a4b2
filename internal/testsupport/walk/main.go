// Command walk measures issue 44's walk of one failed message from the output of
// `dlv trace` (scripts/walk.sh runs the whole of it): the calls from one of the
// repository's functions to another, from the closure engine.Middleware returns to the
// confirmed publish or the settle, and back.
//
//	walk [-want '(*engine).fail'] [-start SYMBOL] TRACE REPO
//
// TRACE is dlv trace's output (its stderr), of a program built with
// -gcflags=all='-N -l' and traced with the regular expression
// 'github.com/amqpretry/amqpretry[./]'; REPO is the repository's root. The walk is the
// first run of -start (one call of it on its goroutine, with everything it calls until
// it returns) that calls -want somewhere. walk prints its tree of calls, each with its
// file, then three figures:
//
//   - hops: the distinct caller->callee pairs. What the compiler makes is skipped, its
//     callees counted as called by its caller: method values' wrappers (X-fm), the
//     wrapper (*T).M of a method with a value receiver T.M (called through a pointer),
//     and the hash and equality functions of map keys (type:.hash.T, type:.eq.T); so
//     are defer wrappers (X.deferwrapN), their callees counted as called by X. A
//     deferred closure X.funcN counts as called by X.
//   - files: the distinct files of the functions on the walk, the closure's included.
//   - returns: the calls from one file into a different file the walk had already
//     entered, each pair counted once; they are listed.
//
// Files are found by parsing REPO's Go files (not tests, not testdata): a traced
// symbol's package directory, receiver type and function name.
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

func main() {
	want := flag.String("want", "(*engine).fail", "a function the walk must call (a symbol, or its end after a dot), to pick the failed message's run among the closure's runs; the settle, (*engine).settle, for delayed-retry")
	start := flag.String("start", "middleware.(*engine).Middleware.func1", "the closure the walk starts at, without the module path")
	module := flag.String("module", "", "the module path (default: REPO's go.mod)")
	tree := flag.Bool("tree", true, "print the tree of calls")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: walk [flags] TRACE REPO")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 2 {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(os.Stdout, flag.Arg(0), flag.Arg(1), *module, *start, *want, *tree); err != nil {
		fmt.Fprintln(os.Stderr, "walk:", err)
		os.Exit(1)
	}
}

func run(w io.Writer, tracePath, root, module, start, want string, tree bool) error {
	if module == "" {
		m, err := modulePath(root)
		if err != nil {
			return err
		}
		module = m
	}
	idx, err := indexRepo(root)
	if err != nil {
		return err
	}
	f, err := os.Open(tracePath)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	segs, err := parseTrace(f, module, start, idx.compilerMade(module))
	if err != nil {
		return fmt.Errorf("%s: %w", tracePath, err)
	}
	seg, ok := pick(segs, want)
	if !ok {
		return fmt.Errorf("%s: none of its %d runs of %s calls %s: was the program built with -gcflags=all='-N -l', and did its message fail?", tracePath, len(segs), start, want)
	}
	wk := measure(seg, func(sym string) string { return idx.fileOf(module, sym) })
	wk.print(w, module, tree)
	return nil
}

// call is one traced call on the walk's goroutine.
type call struct {
	depth  int    // the callers on the stack, as traced
	sym    string // the callee, as traced (with its module path)
	caller string // "" for the walk's first call
	line   int    // its line in the trace, from 1
}

// segment is one run of the start closure: its call first, then every call it makes,
// in order, until it returns.
type segment struct {
	goroutine string
	calls     []call
}

// event is one line of a trace: a call (">") or a return (">>").
type event struct {
	ret       bool
	goroutine string
	sym       string
}

// parseLine reads one line of dlv trace's output:
//
//	> goroutine(25): github.com/x/y/pkg.(*T).M(args...)
//	>> goroutine(25): github.com/x/y/pkg.(*T).M => (results...)
func parseLine(l string) (event, bool) {
	var e event
	switch {
	case strings.HasPrefix(l, ">> goroutine("):
		e.ret, l = true, l[len(">> goroutine("):]
	case strings.HasPrefix(l, "> goroutine("):
		l = l[len("> goroutine("):]
	default:
		return e, false
	}
	g, rest, ok := strings.Cut(l, "): ")
	if !ok {
		return e, false
	}
	if _, err := strconv.Atoi(g); err != nil {
		return e, false
	}
	e.goroutine = g
	// The symbol ends at its arguments' "(" or at " =>"; a "(" right after a dot opens
	// a receiver, "[" a generic's type arguments.
	depth := 0
	for i := 0; i < len(rest); i++ {
		switch c := rest[i]; {
		case c == '[' || (c == '(' && i > 0 && rest[i-1] == '.'):
			depth++
		case (c == ']' || c == ')') && depth > 0:
			depth--
		case depth == 0 && (c == '(' || c == ' '):
			e.sym = rest[:i]
			if e.ret != (c == ' ' && strings.HasPrefix(rest[i:], " =>")) {
				return e, false
			}
			return e, e.sym != ""
		}
	}
	return e, false
}

// parseTrace returns every run of start (a symbol without the module path) in the
// trace, in order, without the calls of the functions drop names (compilerMade).
func parseTrace(r io.Reader, module, start string, drop func(sym string) bool) ([]segment, error) {
	var lines []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1024*1024), 64*1024*1024)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	startSym := qualify(module, start)
	var segs []segment
	for i := 0; i < len(lines); {
		e, ok := parseLine(lines[i])
		if !ok || e.ret || e.sym != startSym {
			i++
			continue
		}
		s := segment{goroutine: e.goroutine}
		var stack []string
		lastRet := ""
		j := i
		for j < len(lines) {
			line := j + 1
			e, ok := parseLine(lines[j])
			j++
			if !ok || e.goroutine != s.goroutine || drop(e.sym) {
				continue
			}
			if !e.ret {
				caller := ""
				if len(stack) > 0 {
					caller = stack[len(stack)-1]
				}
				if x, _, ok := strings.Cut(caller, ".deferwrap"); ok {
					caller = x // X's defer wrapper calls for X
				}
				if lastRet != "" && strings.HasPrefix(e.sym, lastRet+".func") {
					caller = lastRet // a deferred closure runs as its function returns
				}
				s.calls = append(s.calls, call{depth: len(stack), sym: e.sym, caller: caller, line: line})
				stack = append(stack, e.sym)
			} else {
				lastRet = e.sym
				// The innermost frame of the function returns; dlv reports a function
				// with defers returning twice, before and after its deferred calls: the
				// second finds it gone.
				for k := len(stack) - 1; k >= 0; k-- {
					if stack[k] == e.sym {
						stack = stack[:k]
						break
					}
				}
			}
			if len(stack) == 0 {
				break
			}
		}
		segs = append(segs, s)
		i = j
	}
	return segs, nil
}

// qualify turns a symbol without the module path into the traced one.
func qualify(module, sym string) string {
	if strings.HasPrefix(sym, "amqpretry.") && path.Base(module) == "amqpretry" {
		return module + sym[len("amqpretry"):]
	}
	return module + "/" + sym
}

// short drops the module path from a traced symbol: the root package's functions
// keep its name (amqpretry.DecisionOf).
func short(module, sym string) string {
	if rest, ok := strings.CutPrefix(sym, module+"/"); ok {
		return rest
	}
	if rest, ok := strings.CutPrefix(sym, module+"."); ok {
		return path.Base(module) + "." + rest
	}
	return sym
}

// pick returns the first segment that calls want.
func pick(segs []segment, want string) (segment, bool) {
	for _, s := range segs {
		for _, c := range s.calls {
			if c.sym == want || strings.HasSuffix(c.sym, "."+want) || strings.HasSuffix(c.sym, "/"+want) {
				return s, true
			}
		}
	}
	return segment{}, false
}

// walk is what measure finds.
type walk struct {
	seg     segment
	files   []string // sorted
	hops    int
	calls   int // the calls counted, repeats included
	returns []ret
	fileOf  func(string) string
}

// ret is one return: a call from a file into another the walk had entered before.
type ret struct {
	call
	from, to string // files
}

// skipped: a defer wrapper, made by the compiler.
func skipped(sym string) bool { return strings.Contains(sym, ".deferwrap") }

func measure(s segment, fileOf func(string) string) walk {
	w := walk{seg: s, fileOf: fileOf}
	if len(s.calls) == 0 {
		return w
	}
	type pair struct{ caller, callee string }
	hops := map[pair]bool{}
	files := map[string]bool{fileOf(s.calls[0].sym): true}
	for _, c := range s.calls[1:] {
		if skipped(c.sym) {
			continue
		}
		w.calls++
		hops[pair{c.caller, c.sym}] = true
		files[fileOf(c.sym)] = true
	}
	w.hops = len(hops)
	for f := range files {
		w.files = append(w.files, f)
	}
	slices.Sort(w.files)

	seen := map[string]bool{}
	edges := map[pair]bool{}
	for _, c := range s.calls {
		if skipped(c.sym) {
			continue
		}
		p := pair{c.caller, c.sym}
		if c.caller != "" && edges[p] {
			continue
		}
		edges[p] = true
		f := fileOf(c.sym)
		if c.caller != "" {
			if from := fileOf(c.caller); from != f && seen[f] {
				w.returns = append(w.returns, ret{call: c, from: from, to: f})
			}
		}
		seen[f] = true
	}
	return w
}

func (w walk) print(out io.Writer, module string, tree bool) {
	if len(w.seg.calls) == 0 {
		return
	}
	first := w.seg.calls[0]
	fmt.Fprintf(out, "walk: goroutine %s, from %s (trace line %d)\n", w.seg.goroutine, short(module, first.sym), first.line)
	if tree {
		for _, c := range w.seg.calls {
			if skipped(c.sym) {
				continue
			}
			fmt.Fprintf(out, "%s%s  [%s]\n", strings.Repeat("  ", c.depth), short(module, c.sym), w.fileOf(c.sym))
		}
	}
	fmt.Fprintf(out, "\nhops: %d (distinct caller->callee pairs, of %d calls)\n", w.hops, w.calls)
	fmt.Fprintf(out, "files: %d\n", len(w.files))
	for _, f := range w.files {
		fmt.Fprintf(out, "  %s\n", f)
	}
	fmt.Fprintf(out, "returns: %d\n", len(w.returns))
	for _, r := range w.returns {
		fmt.Fprintf(out, "  %s -> %s: %s, called by %s\n", r.from, r.to, short(module, r.sym), short(module, r.caller))
	}
}

// modulePath reads the module line of root's go.mod.
func modulePath(root string) (string, error) {
	b, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if m, ok := strings.CutPrefix(strings.TrimSpace(l), "module "); ok {
			return strings.Trim(strings.TrimSpace(m), `"`), nil
		}
	}
	return "", fmt.Errorf("%s: no module line", filepath.Join(root, "go.mod"))
}

// index maps a function, as package directory (slash-separated, "" for the root),
// receiver type name ("" for none) and name, to its file, relative to the root.
type index map[funcKey]funcDecl

type funcKey struct{ dir, recv, name string }

type funcDecl struct {
	file    string
	pointer bool // its receiver is a pointer
}

// indexRepo parses the non-test Go files under root, leaving out what the go command
// leaves out: testdata, and directories whose names start with "." or "_".
func indexRepo(root string) (index, error) {
	idx := index{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if p != root && (name == "testdata" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		dir := path.Dir(rel)
		if dir == "." {
			dir = ""
		}
		for _, decl := range f.Decls {
			fd, ok := decl.(*ast.FuncDecl)
			if !ok {
				continue
			}
			k, v := funcKey{dir: dir, name: fd.Name.Name}, funcDecl{file: rel}
			if fd.Recv != nil && len(fd.Recv.List) > 0 {
				k.recv = recvName(fd.Recv.List[0].Type)
				_, v.pointer = fd.Recv.List[0].Type.(*ast.StarExpr)
			}
			if _, dup := idx[k]; !dup { // init, or files for different builds
				idx[k] = v
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(idx) == 0 {
		return nil, errors.New(root + ": no Go functions found")
	}
	return idx, nil
}

// recvName is a receiver's type name: T for T, *T, T[K] and *T[K, V].
func recvName(x ast.Expr) string {
	for {
		switch t := x.(type) {
		case *ast.StarExpr:
			x = t.X
		case *ast.ParenExpr:
			x = t.X
		case *ast.IndexExpr:
			x = t.X
		case *ast.IndexListExpr:
			x = t.X
		case *ast.Ident:
			return t.Name
		default:
			return ""
		}
	}
}

// fileOf returns the file of a traced symbol: its function's, for a closure
// (X.func1, X.func1.2), a method value's wrapper (X-fm) or a defer or go wrapper
// (X.deferwrap1, X.gowrap1). Not found: "DIR/?NAME".
func (idx index) fileOf(module, sym string) string {
	dir, recv, name := split(module, sym)
	if f, ok := idx[funcKey{dir, recv, name}]; ok {
		return f.file
	}
	if dir != "" {
		dir += "/"
	}
	return dir + "?" + name
}

// compilerMade reports the functions the compiler makes, which the walk skips:
// method values' wrappers (X-fm), the wrapper (*T).M of a method declared on T,
// and what is not the module's own (type:.hash.T and type:.eq.T, for map keys).
func (idx index) compilerMade(module string) func(sym string) bool {
	return func(sym string) bool {
		if strings.HasSuffix(sym, "-fm") {
			return true
		}
		if !strings.HasPrefix(sym, module+"/") && !strings.HasPrefix(sym, module+".") {
			return true
		}
		dir, recv, name := split(module, sym)
		if recv == "" || !strings.HasSuffix(stripBrackets(sym), ".(*"+recv+")."+name) {
			return false
		}
		f, ok := idx[funcKey{dir, recv, name}]
		return ok && !f.pointer
	}
}

// split parses a traced symbol into package directory, receiver type and name:
//
//	github.com/m/middleware.(*engine).run.func1  ->  middleware, engine, run
//	github.com/m/middleware.Envelope.Write       ->  middleware, Envelope, Write
//	github.com/m.DecisionOf                      ->  "", "", DecisionOf
func split(module, sym string) (dir, recv, name string) {
	sym = stripBrackets(strings.TrimSuffix(sym, "-fm"))
	var rest string
	if r, ok := strings.CutPrefix(sym, module+"/"); ok {
		dir, rest, _ = strings.Cut(r, ".")
	} else if r, ok := strings.CutPrefix(sym, module+"."); ok {
		rest = r
	} else {
		return "?", "", sym
	}
	if strings.HasPrefix(rest, "(") {
		r, after, _ := strings.Cut(rest[1:], ").")
		recv = strings.TrimPrefix(r, "*")
		rest = after
	}
	parts := strings.Split(rest, ".")
	name = parts[0]
	if recv == "" && len(parts) > 1 && !generated(parts[1]) {
		recv, name = parts[0], parts[1] // a method with a value receiver
	}
	return dir, recv, name
}

// generated: a name part the compiler makes (func1, deferwrap1, gowrap1, a closure's
// number within a closure, glob's empty part).
func generated(s string) bool {
	for _, p := range []string{"func", "deferwrap", "gowrap"} {
		s = strings.TrimPrefix(s, p)
	}
	_, err := strconv.Atoi(s)
	return s == "" || err == nil
}

// stripBrackets drops a generic's type arguments: F[...] is F.
func stripBrackets(s string) string {
	var b strings.Builder
	depth := 0
	for _, c := range s {
		switch {
		case c == '[':
			depth++
		case c == ']' && depth > 0:
			depth--
		case depth == 0:
			b.WriteRune(c)
		}
	}
	return b.String()
}
