package middleware

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// TestNoLogLineWithANilError: no ERROR log call anywhere in the repository (every
// module, commands and tools included) passes a literal nil error: watermill's loggers
// print it as err=<nil>. An adjustment goes out at WARN or INFO (notice), a failure
// with its error. The engine's paths that pass a variable are covered by the broker
// tests (gluetest's noNilErr).
func TestNoLogLineWithANilError(t *testing.T) {
	root := ".." // the repository
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) != 3 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || sel.Sel.Name != "Error" {
				return true
			}
			if id, ok := call.Args[1].(*ast.Ident); ok && id.Name == "nil" {
				t.Errorf("%s: an ERROR log line with a nil error (printed as err=<nil>)", fset.Position(call.Pos()))
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
