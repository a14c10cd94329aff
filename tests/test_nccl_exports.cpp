// libnccl.so.2 exports every function NCCL's own header declares (2.28), each also as pnccl*, and
// tutti's nccl.h declares them all too.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <cstdio>

namespace {

std::string read(const char* path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::set<std::string> declared_functions(const std::string& header) {
  std::regex decl(R"((?:ncclResult_t|const char\s*\*|void)\s+(nccl[A-Za-z]+)\s*\()");
  std::set<std::string> declared;
  for (auto it = std::sregex_iterator(header.begin(), header.end(), decl); it != std::sregex_iterator(); ++it)
    declared.insert((*it)[1]);
  return declared;
}

TEST(NcclExports, EveryFunctionOfTheClaimedVersionIsExported) {
  std::ifstream in(NCCL_REAL_HEADER);
  ASSERT_TRUE(in) << "cannot read " << NCCL_REAL_HEADER;
  std::stringstream ss;
  ss << in.rdbuf();
  std::string header = ss.str();
  std::set<std::string> declared = declared_functions(header);
  ASSERT_GE(declared.size(), 40u);
  std::set<std::string> ours = declared_functions(read(TUTTI_SOURCE_DIR "/collectives/include/nccl.h"));
  for (const std::string& name : declared) EXPECT_TRUE(ours.count(name)) << name << " is not declared by tutti's nccl.h";
  void* lib = dlopen(TUTTI_NCCL_LIB, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  int checked = 0;
  for (const std::string& name : declared) {
    EXPECT_NE(dlsym(lib, name.c_str()), nullptr) << name << " is declared by NCCL's header but not exported";
    EXPECT_NE(dlsym(lib, ("p" + name).c_str()), nullptr) << "p" << name << " is not exported";
    ++checked;
  }
  EXPECT_GE(checked, 40);
  using GetVersion = int (*)(int*);
  int version = 0;
  reinterpret_cast<GetVersion>(dlsym(lib, "ncclGetVersion"))(&version);
  EXPECT_EQ(version, 22809);  // what tutti's nccl.h says (NCCL_VERSION_CODE 2.28.9)
  dlclose(lib);
}

// Programs built against today's NCCL (2.28) link to every name its library exports; PyTorch's
// libtorch_cuda.so does, and refuses to load if one is missing. So every nccl*/pnccl* name that
// NVIDIA's libnccl.so.2 exports must be exported here too (nm -D of both).
std::set<std::string> exported(const std::string& lib) {
  std::set<std::string> names;
  FILE* p = popen(("nm -D --defined-only '" + lib + "' 2>/dev/null").c_str(), "r");
  if (!p) return names;
  char line[512];
  while (std::fgets(line, sizeof(line), p)) {
    std::istringstream ls(line);
    std::string addr, kind, name;
    if (ls >> addr >> kind >> name && (name.rfind("nccl", 0) == 0 || name.rfind("pnccl", 0) == 0)) names.insert(name);
  }
  pclose(p);
  return names;
}

TEST(NcclExports, EveryNameNvidiasLibraryExportsIsExportedToo) {
  std::set<std::string> theirs = exported(NCCL_REAL_LIB), ours = exported(TUTTI_NCCL_LIB);
  ASSERT_GE(theirs.size(), 60u) << "could not read the exports of " << NCCL_REAL_LIB << " with nm -D";
  for (const std::string& name : theirs) EXPECT_TRUE(ours.count(name)) << name << " is exported by NVIDIA's library, not by tutti's";
}

}  // namespace
