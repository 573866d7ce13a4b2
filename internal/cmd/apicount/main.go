// Command apicount prints how many exported identifiers each public package of the
// library module declares (top-level names, methods of exported types, methods of
// exported interfaces), and their exported struct fields, and fails when the library's
// packages (every public package but ops, the operations API the amqpretry command is
// built on) declare more than -max, or ops more than -ops-max. The test script runs it
// with the budgets, so the public surface cannot grow by accident. Run it from the
// module root: go run ./internal/cmd/apicount -v
package main

import (
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// aside is the public package counted on its own, outside the library's budget.
const aside = "ops"

func main() {
	limit := flag.Int("max", 0, "fail when the library's packages (all but ops) declare more identifiers than this (0: no limit)")
	opsLimit := flag.Int("ops-max", 0, "fail when ops declares more identifiers than this (0: no limit)")
	verbose := flag.Bool("v", false, "list the identifiers")
	flag.Parse()
	dirs, err := publicDirs(".")
	if err != nil {
		fmt.Fprintln(os.Stderr, "apicount:", err)
		os.Exit(2)
	}
	library, libraryFields, ops := 0, 0, 0
	for _, dir := range dirs {
		names, fields, err := count(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, "apicount:", err)
			os.Exit(2)
		}
		fmt.Printf("%-12s %4d identifiers %4d fields\n", dir, len(names), fields)
		if *verbose {
			fmt.Printf("    %s\n", strings.Join(names, " "))
		}
		if dir == aside {
			ops = len(names)
			continue
		}
		library += len(names)
		libraryFields += fields
	}
	fmt.Printf("%-12s %4d identifiers %4d fields (every package above but %s)\n", "library", library, libraryFields, aside)
	failed := false
	if *limit > 0 && library > *limit {
		fmt.Fprintf(os.Stderr, "apicount: the library's packages export %d identifiers, over the budget of %d: unexport or move what users do not call, configure or match on\n", library, *limit)
		failed = true
	}
	if *opsLimit > 0 && ops > *opsLimit {
		fmt.Fprintf(os.Stderr, "apicount: %s exports %d identifiers, over its budget of %d\n", aside, ops, *opsLimit)
		failed = true
	}
	if failed {
		os.Exit(1)
	}
}

// publicDirs lists the directories of root's module with Go files, leaving out
// internal packages, commands, examples, testdata and nested modules.
func publicDirs(root string) ([]string, error) {
	var dirs []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		base := d.Name()
		if path != root {
			if base == "internal" || base == "cmd" || base == "testdata" || strings.HasPrefix(base, "_") || strings.HasPrefix(base, ".") {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
				return filepath.SkipDir // a module of its own
			}
		}
		matches, _ := filepath.Glob(filepath.Join(path, "*.go"))
		for _, m := range matches {
			if !strings.HasSuffix(m, "_test.go") {
				dirs = append(dirs, path)
				break
			}
		}
		return nil
	})
	sort.Strings(dirs)
	return dirs, err
}

func count(dir string) ([]string, int, error) {
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, dir, func(fi fs.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, 0)
	if err != nil {
		return nil, 0, err
	}
	var names []string
	fields := 0
	for _, p := range pkgs {
		for _, f := range p.Files {
			for _, d := range f.Decls {
				switch d := d.(type) {
				case *ast.FuncDecl:
					if !d.Name.IsExported() {
						continue
					}
					if d.Recv == nil {
						names = append(names, d.Name.Name)
						continue
					}
					t := d.Recv.List[0].Type
					if s, ok := t.(*ast.StarExpr); ok {
						t = s.X
					}
					if id, ok := t.(*ast.Ident); ok && id.IsExported() {
						names = append(names, id.Name+"."+d.Name.Name)
					}
				case *ast.GenDecl:
					for _, s := range d.Specs {
						switch s := s.(type) {
						case *ast.TypeSpec:
							if !s.Name.IsExported() {
								continue
							}
							names = append(names, s.Name.Name)
							switch t := s.Type.(type) {
							case *ast.StructType:
								for _, fl := range t.Fields.List {
									for _, n := range fl.Names {
										if n.IsExported() {
											fields++
										}
									}
								}
							case *ast.InterfaceType:
								for _, m := range t.Methods.List {
									for _, n := range m.Names {
										if n.IsExported() {
											names = append(names, s.Name.Name+"."+n.Name)
										}
									}
								}
							}
						case *ast.ValueSpec:
							for _, n := range s.Names {
								if n.IsExported() {
									names = append(names, n.Name)
								}
							}
						}
					}
				}
			}
		}
	}
	sort.Strings(names)
	return names, fields, nil
}
