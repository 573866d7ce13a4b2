package gluetest

import (
	"flag"
	"go/ast"
	"go/build"
	"go/parser"
	"go/token"
	"go/types"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "write the matrix into docs/watermill-middlewares.md")

// TestMatrixDocs: docs/watermill-middlewares.md shows the matrix MiddlewareMatrix
// asserts (matrixCells), between its markers; -update writes it there.
func TestMatrixDocs(t *testing.T) {
	const path = "../../../docs/watermill-middlewares.md"
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	begin, end := strings.Index(doc, matrixBegin), strings.Index(doc, matrixEnd)
	if begin < 0 || end < begin {
		t.Fatalf("%s has no markers %q ... %q", path, matrixBegin, matrixEnd)
	}
	got, want := doc[begin+len(matrixBegin):end], "\n"+matrixTable()
	if got == want {
		return
	}
	if *update {
		if err := os.WriteFile(path, []byte(doc[:begin+len(matrixBegin)]+want+doc[end:]), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("%s's matrix is not the one the test asserts (matrixCells): run go test ./internal/testsupport/gluetest -run TestMatrixDocs -update", path)
}

// TestMatrixCellsAreWatermills: the matrix has a row for every middleware of the
// version of Watermill's message/router/middleware package this module requires (a
// function that is one or returns one, a type with a Middleware method), and no row
// for another.
func TestMatrixCellsAreWatermills(t *testing.T) {
	pkg, err := build.Import("github.com/ThreeDotsLabs/watermill/message/router/middleware", ".", 0)
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	theirs := map[string]bool{}
	for _, name := range pkg.GoFiles {
		f, err := parser.ParseFile(fset, filepath.Join(pkg.Dir, name), nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || !fn.Name.IsExported() {
				continue
			}
			if fn.Recv != nil {
				recv := fn.Recv.List[0].Type
				if star, ok := recv.(*ast.StarExpr); ok {
					recv = star.X
				}
				if id, ok := recv.(*ast.Ident); ok && id.IsExported() && fn.Name.Name == "Middleware" {
					theirs[id.Name] = true
				}
				continue
			}
			if res := fn.Type.Results; res != nil && strings.Contains(types.ExprString(res.List[0].Type), "Handler") {
				theirs[fn.Name.Name] = true // a HandlerFunc, a HandlerMiddleware, or func(HandlerFunc) HandlerFunc
			}
		}
	}
	// PoisonQueueWithFilter is PoisonQueue's middleware, taking fewer errors.
	delete(theirs, "PoisonQueueWithFilter")
	ours := map[string]bool{}
	for _, mw := range matrixCells() {
		ours[strings.Fields(mw.key)[0]] = true
	}
	if len(theirs) < 10 {
		t.Fatalf("found %d middlewares in %s: %v", len(theirs), pkg.Dir, theirs)
	}
	for name := range theirs {
		if !ours[name] {
			t.Errorf("Watermill's %s has no row in the matrix (matrixCells)", name)
		}
	}
	for name := range ours {
		if !theirs[name] {
			t.Errorf("the matrix has a row for %s, which Watermill's package does not have", name)
		}
	}
}
